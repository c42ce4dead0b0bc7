"""How users reach kiln: the offline API (llm.py), the `kiln` command line (cli/) and the OpenAI-compatible
HTTP server (openai/)."""
