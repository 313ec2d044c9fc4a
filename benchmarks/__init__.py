"""Side-by-side benchmarks of the engine against bare trio, subprocess.Popen and supervisord.

Run them all with ``.venv/bin/python -m benchmarks.run`` (see ``docs/benchmarks/analysis.md``).
"""
