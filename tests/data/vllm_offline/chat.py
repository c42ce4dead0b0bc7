from vllm import LLM, SamplingParams


def print_outputs(outputs):
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {output.outputs[0].text!r}")
    print("-" * 80)


def main():
    llm = LLM(model="facebook/opt-125m")
    sampling_params = SamplingParams(temperature=0.5, max_tokens=16)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # A batch of conversations in one call.
    conversations = [conversation for _ in range(10)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)


if __name__ == "__main__":
    main()
