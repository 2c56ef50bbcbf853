"""`DispatchHold`'s window: what the producer may have issued so that every sample stays within
`max_staleness` of the version it is trained at (the real-server check is `tools/bench/dispatch_hold`)."""

from types import SimpleNamespace

from agrpo_trainer._dispatch_hold import DispatchHold


def test_the_window_is_max_staleness_plus_one_steps_after_a_push_and_one_less_while_a_step_runs():
    hold = DispatchHold(max_staleness=2, weight_sync_steps=1, samples_per_step=16)
    assert hold.allowance(100, step_running=False) == 100 + int(2.5 * 16)  # half a step kept for out-of-order groups
    assert hold.allowance(100, step_running=True) == 100 + int(1.5 * 16)
    on_policy = DispatchHold(max_staleness=0, weight_sync_steps=1, samples_per_step=16)
    assert on_policy.allowance(0, step_running=True) == 0, "on-policy: nothing new until the push"
    assert on_policy.allowance(0, step_running=False) == 16
    every_4 = DispatchHold(max_staleness=1, weight_sync_steps=4, samples_per_step=8)
    assert every_4.allowance(0, step_running=False) == int(1.5 * 8 * 4)


def test_samples_per_step_is_measured_and_widened_when_the_trainer_starves():
    args = SimpleNamespace(
        per_device_train_batch_size=8, gradient_accumulation_steps=2, max_staleness=1, weight_sync_steps=1
    )
    hold = DispatchHold.for_run(args, num_ranks=2)
    assert hold.samples_per_step == 32
    for _ in range(30):
        hold.observe_step(10)
    assert abs(hold.samples_per_step - 10) < 0.1
    hold.starved()
    assert hold.samples_per_step > 12
    hold.observe_step(0)  # an empty step says nothing about S
    assert hold.samples_per_step > 12
