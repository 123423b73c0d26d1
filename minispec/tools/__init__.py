"""The tools' shared layer: prompt sets, tiny random models, settings files and acceptance metrics.

bench, playground, distill, generate's summary and the scripts build on it; the engine (engine/,
spec_decode/, sample/, models/, layers/, llm.py) never imports it.
"""
