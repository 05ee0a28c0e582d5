"""Names of the Medusa layouts Sonar reads, apart from their reader (:mod:`sonar_medusa.layout`,
which imports torch): the plugin names them when it registers, on every configuration check."""

FASTERDECODING = "FasterDecoding Medusa"
VLLM = "vLLM MedusaConfig"
