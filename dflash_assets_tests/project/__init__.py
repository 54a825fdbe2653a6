"""Tests of the project as a whole: imports, pinned dependencies, the README's and the manual's claims."""
