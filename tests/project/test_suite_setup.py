"""The suite's own setup (tests/conftest.py): the files it schedules first are files of the suite."""
import os

from tests.conftest import LONGEST_FIRST
from tests.helpers import ROOT


def test_the_longest_files_listed_exist():
    """A file moved or renamed without its entry in LONGEST_FIRST would be scheduled by name order again."""
    missing = [path for path in LONGEST_FIRST if not os.path.isfile(os.path.join(ROOT, path))]
    assert not missing, f"tests/conftest.py's LONGEST_FIRST names files that are gone: {missing}"
