"""The built-in graders (`simple`: exact, regex and numeric answers; `swebench`: patches).

They are registered, like any plug-in, under the `harnessrl.graders` entry points of this
package's `pyproject.toml`; `harnessrl.reward.grading` finds them there.
"""
