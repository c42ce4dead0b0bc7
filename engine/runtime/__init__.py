"""The engine loop and its faces: EngineCore (schedule -> launch -> process the previous step, in token ids),
LLMEngine (its front: admission in, outputs out), the builder that makes their parts, AsyncEngine (the
server's step thread), output processing and detokenising, request streams, beam search and prefix warm-up."""
