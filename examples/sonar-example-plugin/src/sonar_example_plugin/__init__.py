"""An example Sonar plugin: the ``bigram`` speculation method (see plugin.py and proposer.py)."""
