"""DFlash speculation for Sonar: one non-causal pass drafts a whole block from the target's hidden states."""
