"""The ``draft_model`` speculation method: a smaller causal model drafts tokens for the target."""
