"""The main job, as a workspace script: `uv run python -m tools.demo` is `agrpo-trainer demo`.

The demo itself (settings, run, closing line with the report's path) lives in the trainer package
(`agrpo_trainer._demo`) so that the installed command runs it; this module keeps the old entry point and
the names the tests import. Run as a script, it first starts creating the vLLM environment on a thread (on a
fresh machine that takes up to a minute), so that it overlaps the trainer's imports (about 20 s on 2 cores);
the server's own call waits for it on the environment's file lock.
"""

from __future__ import annotations

import threading

from agrpo_rollout.testing import ensure_vllm_env  # agrpo-rollout imports no torch: this is quick

if __name__ == "__main__":
    threading.Thread(target=ensure_vllm_env, name="agrpo-vllm-env", daemon=True).start()

from agrpo_trainer._demo import PROMPTS, closing_line, demo_config, main, run_demo

__all__ = ["PROMPTS", "closing_line", "demo_config", "main", "run_demo"]

if __name__ == "__main__":
    main()
