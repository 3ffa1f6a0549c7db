"""``python -m lessonlib.grading SUBMISSIONS``: see :mod:`lessonlib.grading`."""

import sys

from lessonlib.grading.submissions import main

if __name__ == "__main__":
    sys.exit(main())
