"""Tests of the project as a whole: imports, pinned dependencies, the README's claims."""
