"""The environment's start-up files (``*.pth``, ``sitecustomize``) as the grader's release check sees them: one that
no installed package lists is refused unless the environment record, written at install, holds it as it is
(virtualenv's ``_virtualenv.pth`` and a platform's own ``.pth`` files are such; the H200 lab's Python has two)."""

import sys

import pytest

from lessonlib.grading import release
from tests.test_grading_judge import checkout  # noqa: F401 (fixture)

UNLISTED = "import os  # a start-up file no package lists\n"


@pytest.fixture()
def environment(tmp_path, monkeypatch):
    """A stand-in environment folder holding one .pth that no package lists, seen as the environment's own."""
    prefix = tmp_path / "env"
    site = prefix / "site-packages"
    site.mkdir(parents=True)
    pth = site / "_platform.pth"
    pth.write_text(UNLISTED)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(release, "site_folders", lambda: [site])
    return pth


def test_an_unlisted_startup_file_is_refused_until_recorded_at_install(checkout, environment):  # noqa: F811
    with pytest.raises(release.CourseChanged) as refused:
        release.Course(checkout, checkout / "notebooks")
    message = str(refused.value)
    assert f"{environment} is listed by no installed package nor in the environment record" in message
    assert "python -m lessonlib.grading.release" in message
    written = release.write_environment()
    assert written.parent == environment.parent.parent
    course = release.Course(checkout, checkout / "notebooks")  # recorded as it is: accepted
    assert course.repair() == []


@pytest.mark.parametrize("plant", ["changed", "added"])
def test_a_startup_file_changed_or_added_after_the_record_is_refused(checkout, environment, plant):  # noqa: F811
    release.write_environment()
    planted = environment if plant == "changed" else environment.with_name("zz_planted.pth")
    planted.write_text(UNLISTED + "import this\n")
    with pytest.raises(release.CourseChanged, match=f"{planted.name} is listed by no installed package"):
        release.Course(checkout, checkout / "notebooks")
