"""What was checked is what is used: a run's files are read once, never through a link, and the store receives the
bytes of that read, pinned by their hash, whatever happens to the files on disk between the check and the publish.
Tried as a teammate who can write the inputs folder would: swapping a checked file for a link to a key file, or for
other bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tasks.storage.artifacts import chat_template_store_path, check_chat_template_file, publish_run_inputs
from tasks.storage.run_files import RunFileRefused, _copy_unfollowed, read_run_files

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOKEN = "hf_the_control_planes_own_token_0123456789"


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "chat.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A key of the control plane's host, outside the inputs folder."""
    path = tmp_path / "home" / ".cache" / "huggingface" / "token"
    path.parent.mkdir(parents=True)
    path.write_text(TOKEN)
    return path


def read_template(inputs: Path, tmp_path: Path):
    return read_run_files([("training.chat_template", "chat.jinja")], tmp_path / "read", base_dir=inputs,
                          inputs_dir=inputs)


def test_a_template_swapped_for_a_link_after_the_check_never_reaches_the_store(inputs, token_file, tmp_path):
    files = read_template(inputs, tmp_path)
    assert check_chat_template_file("chat.jinja", files) is not None  # checked
    (inputs / "chat.jinja").unlink()
    (inputs / "chat.jinja").symlink_to(token_file)  # swapped between the check and the publish

    _, _, stored = publish_run_inputs((tmp_path / "store").as_uri(), "r1", files, [])

    stored_template = tmp_path / "store" / chat_template_store_path("r1")
    assert stored_template.read_text() == TEMPLATE
    assert stored.sha256[chat_template_store_path("r1")] == hashlib.sha256(TEMPLATE.encode()).hexdigest()
    assert not any(TOKEN in path.read_text() for path in (tmp_path / "store").rglob("*") if path.is_file())


def test_a_template_rewritten_after_the_check_is_stored_as_it_was_checked(inputs, tmp_path):
    files = read_template(inputs, tmp_path)
    (inputs / "chat.jinja").write_text("{{ raise_exception('not the checked template') }}")

    _, _, stored = publish_run_inputs((tmp_path / "store").as_uri(), "r1", files, [])

    assert (tmp_path / "store" / chat_template_store_path("r1")).read_text() == TEMPLATE
    assert stored.sha256[chat_template_store_path("r1")] == hashlib.sha256(TEMPLATE.encode()).hexdigest()


def test_a_link_put_in_the_files_place_after_its_path_resolved_is_refused_naming_the_field(inputs, token_file,
                                                                                            tmp_path):
    # The state a swap leaves between the path's resolution (and its check against the inputs folder) and the open.
    (inputs / "chat.jinja").unlink()
    (inputs / "chat.jinja").symlink_to(token_file)
    with pytest.raises(RunFileRefused, match=r"^training.chat_template chat.jinja \(.*\) became a symbolic link after "
                                             r"its path was resolved"):
        _copy_unfollowed("training.chat_template", "chat.jinja", inputs / "chat.jinja", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_a_link_that_leads_out_of_the_inputs_folder_is_refused_at_the_read_naming_the_field(inputs, token_file,
                                                                                          tmp_path):
    # Swapped in after the server's rules passed the run: the read itself holds the inputs folder's rule.
    (inputs / "chat.jinja").unlink()
    (inputs / "chat.jinja").symlink_to(token_file)
    with pytest.raises(RunFileRefused, match=r"^training.chat_template chat.jinja \(.*/token\) is outside this "
                                             r"server's inputs folder .*\(LORAFLOW_INPUTS_DIR\)"):
        read_template(inputs, tmp_path)


def test_a_link_inside_the_inputs_folder_to_a_file_inside_it_is_read_where_it_leads(inputs, tmp_path):
    (inputs / "alias.jinja").symlink_to(inputs / "chat.jinja")
    files = read_run_files([("training.chat_template", "alias.jinja")], tmp_path / "read", base_dir=inputs,
                           inputs_dir=inputs)
    assert files["training.chat_template"].location == inputs / "chat.jinja"
    assert files["training.chat_template"].copy.read_text() == TEMPLATE


def test_a_folder_that_became_a_link_after_its_path_resolved_is_refused_naming_the_field(inputs, token_file,
                                                                                       tmp_path):
    # The state a swap leaves between the path's resolution and the open: a folder on the resolved path is now a
    # link (to the key's folder).
    (inputs / "alice").symlink_to(token_file.parent)
    with pytest.raises(RunFileRefused, match=r"^training.chat_template alice/token \(.*\): a folder above it became a link"):
        _copy_unfollowed("training.chat_template", "alice/token", inputs / "alice" / "token", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_a_folder_link_that_leads_out_of_the_inputs_folder_is_refused_naming_the_setting(inputs, token_file,
                                                                                       tmp_path):
    (inputs / "alice").symlink_to(token_file.parent)
    with pytest.raises(RunFileRefused, match=r"^dataset.local_file alice/token \(.*\) is outside this server's inputs "
                                             r"folder .*\(LORAFLOW_INPUTS_DIR\)"):
        read_run_files([("dataset.local_file", "alice/token")], tmp_path / "read", base_dir=inputs,
                       inputs_dir=inputs)


def test_a_folder_link_the_operator_made_inside_the_inputs_folder_is_followed(inputs, tmp_path):
    (inputs / "shared").mkdir()
    (inputs / "shared" / "chat.jinja").write_text(TEMPLATE)
    (inputs / "team").symlink_to(inputs / "shared")
    files = read_run_files([("training.chat_template", "team/chat.jinja")], tmp_path / "read", base_dir=inputs,
                           inputs_dir=inputs)
    assert files["training.chat_template"].copy.read_text() == TEMPLATE


def test_something_that_is_not_a_regular_file_is_refused_without_waiting_on_it(inputs, tmp_path):
    os.mkfifo(inputs / "pipe.jinja")  # opening a FIFO to read would block until someone writes
    with pytest.raises(RunFileRefused, match=r"^training.chat_template pipe.jinja \(.*\) is not a regular file"):
        read_run_files([("training.chat_template", "pipe.jinja")], tmp_path / "read", base_dir=inputs)


def test_the_copies_are_private_to_the_control_planes_process(inputs, tmp_path):
    copy = read_template(inputs, tmp_path)["training.chat_template"].copy
    assert copy.stat().st_mode & 0o077 == 0 and copy.parent.stat().st_mode & 0o077 == 0
