"""The options layer is light: a rank reads its options before importing numpy, pyarrow or torch."""

import subprocess
import sys


def test_importing_the_options_layer_pulls_in_nothing_heavy():
    code = (
        "import sys, hyperacc.options, hyperacc.process\n"
        "heavy = sorted(m for m in ('numpy', 'scipy', 'pyarrow', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
