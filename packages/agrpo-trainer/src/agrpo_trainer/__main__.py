"""`python -m agrpo_trainer ...` (and `accelerate launch -m agrpo_trainer ...`): the `agrpo-trainer` command."""

from agrpo_trainer._cli import main

if __name__ == "__main__":  # spawned rollout workers re-import this module: only the real main runs it
    main()
