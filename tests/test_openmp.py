"""The node's OpenMP waiting policy: set by whoever starts a node, never by importing one."""

from __future__ import annotations

import os
import subprocess
import sys

from services.node.engine.openmp import OPENMP_DEFAULTS, configure, missing


def test_configure_fills_in_only_what_the_operator_left_unset() -> None:
    environ = {"GOMP_SPINCOUNT": "5"}
    configure(environ)
    assert environ == {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "PASSIVE"}
    assert missing(environ) == [] and missing({}) == list(OPENMP_DEFAULTS)


def test_importing_the_node_package_changes_no_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_DEFAULTS}
    probe = "import os, services.node, services.node.settings; print(sorted(k for k in os.environ if 'OMP' in k))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sorted(k for k in env if "OMP" in k))
