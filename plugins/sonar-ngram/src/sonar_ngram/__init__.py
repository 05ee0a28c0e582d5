"""Prompt-lookup (n-gram) speculation for Sonar: the ``ngram`` and ``ngram_gpu`` methods.

The plugin's hooks live in :mod:`sonar_ngram.plugin`, found through the ``sonar`` entry-point group.
"""

__version__ = "0.1.0"
