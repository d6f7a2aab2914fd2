"""What changed between the stored runs of the demo table in `benchmarks/README.md`, oldest first (rendered under
it by :mod:`host_readme`): one paragraph per session of changes, with the commits and where their results are stored.
The paragraphs live in ``demo_notes.md``, one line each with a blank line before it (as they are rendered).
"""

from pathlib import Path

DEMO_NOTES = tuple((Path(__file__).resolve().parent / "demo_notes.md").read_text().splitlines())
