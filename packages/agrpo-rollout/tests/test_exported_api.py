import subprocess
import sys

import agrpo_rollout

EXPECTED = [
    "AssistantMessage",
    "AsyncRolloutLoop",
    "ConcurrencyController",
    "DatasetError",
    "ExpertRouting",
    "GroupOutcome",
    "PACK_FIELDS",
    "PromptsExhaustedError",
    "ReconcileStats",
    "RequestRejectedError",
    "ResponseFormatError",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutGroup",
    "RolloutSample",
    "ServerConfigError",
    "ServerError",
    "ServerEvent",
    "ServerInfo",
    "ServerLoad",
    "ServerLostError",
    "ServerUnavailableError",
    "ToolOutcome",
    "ToolSetupError",
    "Toolbox",
    "TopLogprobs",
    "TrainingSequence",
    "TurnRecord",
    "VLLMClient",
    "build_sequences",
    "check_routed_experts",
    "decode_completion",
    "decode_generate",
    "group_advantages",
    "is_trainable",
]


def test_all_is_frozen_and_sorted():
    assert agrpo_rollout.__all__ == EXPECTED
    assert sorted(agrpo_rollout.__all__) == agrpo_rollout.__all__
    for name in EXPECTED:
        assert getattr(agrpo_rollout, name) is not None


def test_import_pulls_neither_torch_nor_transformers():
    code = "import sys, agrpo_rollout; print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
