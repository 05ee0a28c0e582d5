"""EAGLE speculation for Sonar: draft heads that read the target's hidden states (eagle, eagle3)."""
