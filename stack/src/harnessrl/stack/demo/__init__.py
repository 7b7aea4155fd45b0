"""The built-in demo: two-turn multiplication with a calculator tool, trained through the whole system.

The task is "What is a*b?" with a, b in 10..99. The model answers `ANSWER n` directly or asks the
harness's calculator with `CALC a*b`, gets `RESULT v` back and then answers. Reward 1 for the right
final answer. A warm-started 0.5M-parameter model rarely calls the tool, and mostly gets the product
wrong; what RL teaches it is when to call the tool. Held-out pairs are never trained on.
"""
