"""Names of the EAGLE layouts Sonar reads, apart from their reader (:mod:`sonar_eagle.layout`,
which imports torch): the plugin names them when it registers, on every configuration check."""

SAFEAILAB_EAGLE1 = "SafeAILab EAGLE-1"
SAFEAILAB_EAGLE3 = "SafeAILab EAGLE-3"
SPECULATORS_EAGLE3 = "speculators eagle3"
