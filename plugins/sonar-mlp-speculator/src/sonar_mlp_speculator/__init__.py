"""IBM's MLP speculator for Sonar: a chain of small MLP stages on the target's final hidden state."""
