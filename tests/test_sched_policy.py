"""tpserve/sched_policy.py: every thread of the process takes the policy, later threads and children inherit it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tpserve import sched_policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies are Linux's")

# Run in a child process: the policy is the test process's own otherwise.
_CHILD = r"""
import json, os, subprocess, sys, threading
from tpserve.sched_policy import policy_name, set_policy

ready, done = threading.Event(), threading.Event()
seen = {}
def early():  # started before set_policy: must be switched too
    ready.set(); done.wait(); seen["early"] = policy_name()
thread = threading.Thread(target=early); thread.start(); ready.wait()
ok = set_policy("batch")
late = []
threading.Thread(target=lambda: late.append(policy_name())).start()
done.set(); thread.join()
child = subprocess.run([sys.executable, "-c", "from tpserve.sched_policy import policy_name; print(policy_name())"],
                       capture_output=True, text=True, check=True).stdout.strip()
back = set_policy("other")
print(json.dumps({"ok": ok, "main": "batch" if ok else None, "early": seen["early"], "late": late[0] if late else None,
                  "child": child, "back": back, "after": policy_name()}))
"""


def test_every_thread_takes_the_policy_and_what_starts_later_inherits_it():
    out = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out == {"ok": True, "main": "batch", "early": "batch", "late": "batch", "child": "batch", "back": True,
                   "after": "other"}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        sched_policy.set_policy("fifo")

