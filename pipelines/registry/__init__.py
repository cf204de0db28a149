"""The artifact registry: bundles pushed and pulled as OCI artifacts (client.py), their manifests
and layers (artifact.py), a local OCI layout (layout.py) and OCI distribution registries (remote.py)."""
