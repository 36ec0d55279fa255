"""transformers' greedy continuations computed in a separate process with fla blocked.

transformers swaps in fla's Triton kernels for Gated DeltaNet whenever ``fla`` imports
(``reference/models.md`` §0.1): on the GPU machine that would make the "reference" fla itself
(and on CPU tensors it fails). Blocking fla in the test process would also block Weir's own fla
backend, so the reference runs in a child process whose ``sys.modules`` hides fla and Dao's
conv package before transformers is imported.

    python hf_reference.py MODEL_DIR REQUEST.json OUT.pt
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_BLOCKED = ("fla", "causal_conv1d", "mamba_ssm")


def hf_greedy_in_subprocess(model_path, prompts: list[list[int]], num_tokens: int, device: str = "cpu",
                            dtype: str = "float32") -> list[tuple[list[int], torch.Tensor]]:
    """``[(greedy tokens, logits [num_tokens, V] fp32 on the CPU)]`` per prompt, EOS ignored."""
    with tempfile.TemporaryDirectory() as folder:
        request = Path(folder) / "request.json"
        result = Path(folder) / "result.pt"
        request.write_text(json.dumps({"prompts": prompts, "num_tokens": num_tokens, "device": device,
                                       "dtype": dtype}))
        completed = subprocess.run([sys.executable, __file__, str(model_path), str(request), str(result)],
                                   capture_output=True, text=True, timeout=1800)
        assert completed.returncode == 0, completed.stderr[-6000:]
        return torch.load(result)


@torch.no_grad()
def _greedy(model, prompt_ids: list[int], num_tokens: int, device: str):
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_tokens):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits.cpu())
        tokens.append(int(step_logits.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens, torch.stack(logits)


def _main(model_path: str, request_path: str, result_path: str) -> None:
    for name in _BLOCKED:
        sys.modules[name] = None  # import raises ImportError: transformers uses its torch code
    from transformers import AutoModelForCausalLM

    request = json.loads(Path(request_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, request["dtype"]))
    model = model.to(request["device"])
    results = [_greedy(model, prompt, request["num_tokens"], request["device"]) for prompt in request["prompts"]]
    torch.save(results, result_path)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
