"""Live-test groups: each device call runs one (``bash h200/run.sh --group N``).

The H200's device tool kills a command after 600 s; every live test at once took longer,
and the killed call left its detached workflow and SGLang server on the warm machine.  So
the tests are split into groups, each one call under run.sh's 540 s limit, and a test not
in exactly one group is a collection error rather than a test no group runs.
"""

from __future__ import annotations

import os

import pytest

#: Group number -> the live tests it runs (function names in tests/live/test_*.py).
GROUPS: dict[str, tuple[str, ...]] = {
    "1": ("test_the_workflow_end_to_end_on_a_live_sglang",),
    "2": ("test_fidelity_across_chunking_batching_capture_and_architectures",),
    "3": ("test_real_faults_a_killed_server_and_a_busy_gpu",),
    # Data parallel on one GPU (test_dp_live.py).  Seen 2026-12-02: fixture ~60 s, then
    # ~120 s per dp-2 workflow, so the three variants fit one call and the kill gets its own.
    "4": ("test_dp2_on_one_gpu_end_to_end",),
    "5": ("test_dp_worker_killed_mid_chunk_on_live_sglang",),
    # A release end to end (issue 22: each release the H200 runs, 0.5.14 - 0.5.17, one call
    # each): hooks, then the patch with one chunk redone, both against HF.  Estimated
    # (group 1 and 4's figures): fixture ~60 s, ~80-120 s per workflow, ~40 s the rerun.
    "6": ("test_a_release_end_to_end_hooks_and_patch",),
    # The audit on a third architecture (a tiny Llama through hooks), then the same run with
    # a wrong capture injected in the server (faults.captured_batch): two workflows.
    "7": ("test_the_audit_passes_a_live_llama_run_and_catches_an_injected_error",),
    # The audit on the Qwen3 the module fixture builds (one workflow through hooks).
    "8": ("test_the_audit_passes_a_live_qwen3_run",),
}
GROUP_ENV = "HSEXTRACT_LIVE_GROUP"


def pytest_collection_modifyitems(config, items):
    group = os.environ.get(GROUP_ENV)
    if not group:
        return
    if group not in GROUPS:
        raise pytest.UsageError(f"${GROUP_ENV}={group}: no such group; groups: {sorted(GROUPS)}")
    live = [i for i in items if i.get_closest_marker("sglang_live")]
    for item in live:
        homes = [g for g, names in GROUPS.items() if item.originalname in names]
        if len(homes) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} is in groups {homes}: put it in exactly one of "
                "tests/live/conftest.py's GROUPS (each group runs under 540 s)"
            )
    keep = [i for i in live if i.originalname in GROUPS[group]]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
