"""Run by the python of a vLLM environment: validate this server's answers (a JSON file, argv[1])
with vLLM's own response models; prints ``ALL OK`` when every one validates."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateResponse,
        GenerateStreamResponse,
    )
    from vllm.entrypoints.serve.engine.protocol import ModelList
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeResponse, TokenizeResponse

    answers = json.loads(open(sys.argv[1]).read())
    checks = {"generate": TypeAdapter(GenerateResponse).validate_python,
              "generate_text": TypeAdapter(GenerateResponse).validate_python,
              "completion": CompletionResponse.model_validate,
              "chat": ChatCompletionResponse.model_validate,
              "tokenize": TokenizeResponse.model_validate,
              "detokenize": DetokenizeResponse.model_validate,
              "models": ModelList.model_validate}
    for name, check in checks.items():
        check(answers[name])
    for chunk in answers["generate_stream"]:
        TypeAdapter(GenerateStreamResponse).validate_python(chunk)
    print("ALL OK")


if __name__ == "__main__":
    main()
