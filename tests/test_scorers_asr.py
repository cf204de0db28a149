"""The built-in ASR scorer (pocketsphinx's bundled en-US model) on real speech made by espeak-ng:
identical audio scores 0, the same sentence under noise less than another sentence."""
import shutil
import subprocess

import pytest
import torch

from pipelines.codec_eval import read_wav
from pipelines.scorers import PocketSphinxCER, edit_distance, load_scorers

pytest.importorskip("pocketsphinx", reason="pocketsphinx is the '.[speech]' extra (make install has it)")
ESPEAK = shutil.which("espeak-ng")


def speak(text, path):
    subprocess.run([ESPEAK, "-v", "en-us", "-s", "140", "-w", str(path), text], check=True)
    return read_wav(path)


def test_edit_distance():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("ab", "ab") == 0


@pytest.mark.skipif(ESPEAK is None, reason="espeak-ng not installed (scripts/install-speech-tools.sh)")
def test_asr_scorer_on_espeak_speech(tmp_path):
    (scorer,) = load_scorers(["pipelines.scorers:PocketSphinxCER"])
    assert isinstance(scorer, PocketSphinxCER)
    fox, sr = speak("the quick brown fox jumps over the lazy dog", tmp_path / "fox.wav")
    news, sr2 = speak("good morning and welcome to the evening news", tmp_path / "news.wav")
    assert sr == sr2
    said = "good morning and welcome to the evening news".split()
    heard = scorer.transcribe(news, sr, "t").split()
    assert len(set(heard) & set(said)) >= 4, heard  # it hears the words (espeak's voice is hard for it), not noise
    g = torch.Generator().manual_seed(0)
    noisy = fox + torch.randn(fox.shape, generator=g) * fox.std() * 10 ** (-30 / 20)  # 30 dB SNR
    ctx = {"sampling_rate": sr, "set": "t"}
    same, close, other = (scorer.score([fox], [x], ctx)["cer"] for x in (fox, noisy, news))
    assert same == 0.0 and close < other and other > 0.5
