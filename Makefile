# moss-quant: everything runs inside .venv, created on first use.
PY      := .venv/bin/python
MQ      := .venv/bin/mossquant
PROFILE ?= rtn4
MODEL   ?= moss-tts
PROFILES := $(basename $(notdir $(wildcard configs/profiles/*.yaml)))
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install quantize test demo push rebuild report fixture bench determinism clean pareto

# torch is pinned (constraints.txt): a range admitting newer releases pulls a multi-GB CUDA build.
# autoawq 0.2.9 goes in with --no-deps: its triton pin is not needed on CPU.
.venv/.installed: pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[methods,registry,report,test,gguf,speech]'
	$(PY) -m pip install -q -c constraints.txt --no-deps autoawq==0.2.9
	touch $@

install: .venv/.installed

quantize: install
	$(MQ) quantize $(PROFILE) --model $(MODEL)

fixture: install
	$(MQ) fixture $(or $(NAME),tiny)

# The test command installs what its tests need: the registry tests' server (Debian's docker-registry).
# espeak-ng: speech for the ASR scorer's test (scripts/install-speech-tools.sh).
test: install .tools/docker-registry/usr/bin/docker-registry
	bash scripts/install-speech-tools.sh
	$(PY) -m pytest tests

.tools/docker-registry/usr/bin/docker-registry:
	bash scripts/install-registry.sh

# Every profile on the tiny fixtures (a rejected bundle is a verdict, not a failure), then the report.
demo: install
	@for p in $(PROFILES); do \
	  echo "== $$p"; $(MQ) quantize $$p --model tiny; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 3 ]; then exit $$rc; fi; \
	done
	$(MQ) report tiny
	$(MQ) report codec-tiny

push: install
	$(MQ) push --newest $(MODEL)/$(PROFILE) $(REGISTRY) $(if $(FORCE),--force,)

rebuild: install
	$(MQ) rebuild --profile $(PROFILE) --model $(MODEL)

report: install
	$(MQ) report $(MODEL)

bench: install
	$(PY) bench/run.py $(BENCH_ARGS)

# The README's determinism matrix: CPU cells measured here; GPU cells from bench/results/determinism-gpu.json
# (the same script with --cells cpu-gpu,gpu-rerun on a GPU machine).
determinism: install
	$(PY) bench/determinism.py --cells rerun,cpu-kernel --out bench/results/determinism-cpu.json > /dev/null
	$(PY) bench/determinism.py --table bench/results/determinism-*.json

clean:
	rm -rf artifacts/.cache

# Uniform points for the report's Pareto plot: RTN (rtn4's grid) and auto-round (autoround-q3's) at 2, 3 and 4
# bits beside the profiles themselves (each a version of its profile; a rejected one is a point too).
pareto: install
	@for b in 2 3; do $(MQ) quantize rtn4 --model $(MODEL) --set quantize.bits=$$b; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 3 ]; then exit $$rc; fi; done
	@for b in 2 4; do $(MQ) quantize autoround-q3 --model $(MODEL) --set quantize.bits=$$b; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 3 ]; then exit $$rc; fi; done
	$(MQ) report $(MODEL)
