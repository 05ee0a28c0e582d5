"""The extract_hidden_states method: the target's hidden states of every request, written to files."""
