"""Samplers: turn prompts into finished multi-turn trajectories with the current student weights.

`opd.sampling.base.Sampler` is the one interface the trainer sees; each engine is a class in its
own module, registered here by its `rollout.engine` name. Adding an engine is one new file with a
`Sampler` subclass plus one line below (CONTRIBUTING.md shows it). Entries are "module:Class"
strings, so importing this package imports no engine (vLLM loads only when chosen); the
config layer reads the names, `opd.sampling.base.sampler_class` loads one.
"""

SAMPLERS = {
    "hf": "opd.sampling.hf:HFSampler",
    "vllm": "opd.sampling.vllm:VLLMSampler",
}
