"""MTP speculation for Sonar: the ``mtp`` method and its old model-family names."""
