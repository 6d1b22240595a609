"""How many threads the native CPU step takes (engine/native_decode.py ThreadChoice): all cores
while they are the engine's, one while another process holds a core, all again once a later try
finds them free. Pure logic, fed step timings (a real contended run is
engine/bench/experiments/native_contention.py)."""

from engine.native_decode import ThreadChoice


def test_steps_keep_every_thread_while_the_calling_thread_runs_throughout():
    choice = ThreadChoice(2)
    for i in range(5):
        assert choice.for_step(i * 0.1) == 2
        choice.record(2, wall_s=0.06, cpu_s=0.059, now=i * 0.1 + 0.06)


def test_a_step_that_waited_for_its_cores_goes_down_to_one_thread_then_tries_again():
    choice = ThreadChoice(2, retry_s=1.0)
    assert choice.for_step(0.0) == 2
    choice.record(2, wall_s=0.3, cpu_s=0.12, now=0.3)  # the calling thread ran 40% of the step
    assert choice.for_step(0.4) == 1 and choice.for_step(1.2) == 1
    assert choice.for_step(1.31) == 2  # a try after retry_s
    choice.record(2, wall_s=0.06, cpu_s=0.06, now=1.37)  # the cores are free again
    assert choice.for_step(1.4) == 2


def test_tries_that_find_the_cores_still_shared_wait_twice_as_long_up_to_a_bound():
    choice = ThreadChoice(2, retry_s=1.0, max_retry_s=4.0)
    now = 0.0
    choice.for_step(now)
    choice.record(2, wall_s=0.3, cpu_s=0.1, now=now)
    waits = []
    for _ in range(4):  # each try finds the cores shared
        start = now
        while choice.for_step(now) == 1:
            now += 0.25
        waits.append(now - start)
        choice.record(2, wall_s=0.3, cpu_s=0.1, now=now)
    assert waits == [1.0, 2.0, 4.0, 4.0], waits
    choice.for_step(now + 10)
    choice.record(2, wall_s=0.06, cpu_s=0.06, now=now + 10)  # free again: the next wait is short
    assert choice.wait_s == 1.0


def test_short_steps_and_fixed_choices_never_switch():
    choice = ThreadChoice(2)
    choice.record(2, wall_s=0.001, cpu_s=0.0, now=0.0)  # too short to tell
    assert choice.for_step(0.01) == 2
    fixed = ThreadChoice(2, adaptive=False)
    fixed.record(2, wall_s=0.3, cpu_s=0.01, now=0.3)
    assert fixed.for_step(0.4) == 2


def test_one_thread_steps_go_back_to_every_thread_once_the_other_cores_sat_idle():
    choice = ThreadChoice(2, retry_s=100.0)  # no timed try in this test
    choice.for_step(0.0)
    choice.record(2, wall_s=0.3, cpu_s=0.1, now=0.3)
    assert choice.for_step(0.4) == 1
    choice.record(1, wall_s=0.1, cpu_s=0.1, now=0.5, idle_s=0.02)  # the other core mostly busy
    assert choice.for_step(0.6) == 1
    choice.record(1, wall_s=0.1, cpu_s=0.1, now=0.7, idle_s=0.09)  # it sat idle: take it back
    assert choice.for_step(0.8) == 2


def test_the_machines_idle_time_is_read_and_grows():
    import time

    from engine.native_decode import idle_seconds

    first = idle_seconds()
    time.sleep(0.05)
    assert first is not None and idle_seconds() >= first
