"""The main job, as a workspace script: `uv run python -m tools.demo` is `agrpo-trainer demo`.

The demo itself (settings, run, closing line with the report's path) lives in the trainer package
(`agrpo_trainer._demo`) so that the installed command runs it; this module keeps the old entry point and
the names the tests import.
"""

from __future__ import annotations

from agrpo_trainer._demo import PROMPTS, closing_line, demo_config, main, run_demo

__all__ = ["PROMPTS", "closing_line", "demo_config", "main", "run_demo"]

if __name__ == "__main__":
    main()
