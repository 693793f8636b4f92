"""Greedy tokens from each engine's own library, the oracle of the served engines: transformers' `generate`
(in this process) and vLLM's `LLM.generate` (in a process of its own, as vLLM's users run it: its engine core
in a child process, so nothing of it stays in the test process).

    python -m tests.iwg_worker.driver.oracle MODEL_DIR MAX_TOKENS < prompts.json > tokens.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
MARK = "oracle tokens: "  # vLLM logs to stdout too: the answer is the line that starts so


def library_greedy(
    engine: str, model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    if engine == "vllm":
        return _vllm_greedy(model_dir, prompts, max_tokens)
    return _transformers_greedy(model_dir, prompts, max_tokens)


def _transformers_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from iwg_worker.models.loading import load_causal_lm, model_source

    model: Any = load_causal_lm(model_source(model_dir), torch.float32).eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
            )
            answers.append([int(t) for t in out[0, len(prompt) :]])
    return answers


def _vllm_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.iwg_worker.driver.oracle", str(model_dir), str(max_tokens)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    assert lines, result.stdout[-3000:]
    answers: list[list[int]] = json.loads(lines[-1].removeprefix(MARK))
    return answers


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
    prompts = json.loads(sys.stdin.read())
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 30)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    print(MARK + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
