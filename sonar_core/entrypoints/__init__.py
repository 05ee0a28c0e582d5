"""What users run: the ``aphrodite`` command (``cli``), the ``LLM`` class (``llm``) and the
OpenAI-compatible server (``openai``)."""
