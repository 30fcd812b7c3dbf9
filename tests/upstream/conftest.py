import pytest

# harness.py holds the ports' shared asserts: rewritten like a test module's
pytest.register_assert_rewrite("tests.upstream.harness")
