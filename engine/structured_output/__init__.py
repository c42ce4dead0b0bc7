"""Structured outputs: grammars from JSON schemas, regexes and EBNF (xgrammar), compiled off the server's
threads in a worker pool."""
