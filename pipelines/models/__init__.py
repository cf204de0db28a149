"""Model definitions with the upstream tensor names (no remote code)."""
