"""The examples run as a reader would run them, and check what they claim."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_try_it_checks_a_column_layer_against_f_linear_on_two_ranks():
    result = subprocess.run([sys.executable, "-m", "tensor_parallel_toy.examples.try_it"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}: output, dX and dW equal F.linear's" for r in range(2)], (
        result.stdout + result.stderr)

