from vllm import LLM, SamplingParams


def main():
    llm = LLM(model="facebook/opt-125m", seed=0)
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer.encode("The capital of France is")
    prompts = [
        {"prompt_token_ids": token_ids},  # TokensPrompt
        {"prompt": "The future of AI is"},  # TextPrompt
        "Hello, my name is",
    ]
    sampling_params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=42)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt token ids: {output.prompt_token_ids}")
        for sample in output.outputs:
            print(f"  {sample.index}: {sample.text!r} {list(sample.token_ids)} ({sample.finish_reason})")


if __name__ == "__main__":
    main()
