"""SWE-Lite (issue 32): repository-repair tasks run in a bubblewrap sandbox."""
