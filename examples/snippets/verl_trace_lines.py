# Trace lines from verl's update_actor (prompts left-padded, responses right-padded). `data`
# here is a STAND-IN for verl's DataProto (the same field names and layout, random values;
# two samples per prompt).
import json
from types import SimpleNamespace

import torch

B, P, R = 4, 6, 5
mask = torch.ones(B, P + R, dtype=torch.int64)
mask[:, :2] = 0                      # left padding of the prompts
mask[:, P + 3:] = 0                  # right padding of the responses
data = SimpleNamespace(batch={
    "prompts": torch.randint(1, 100, (B // 2, P)).repeat_interleave(2, 0), "responses": torch.randint(1, 100, (B, R)),
    "attention_mask": mask, "response_mask": mask[:, P:].float(),
    "advantages": torch.randn(B, R), "old_log_probs": -torch.rand(B, R),
    "ref_log_prob": -torch.rand(B, R)}, non_tensor_batch={"uid": ["q0", "q0", "q1", "q1"]})
data.batch["input_ids"] = torch.cat([data.batch["prompts"], data.batch["responses"]], dim=1)
step = 0

b, uid = data.batch, data.non_tensor_batch["uid"]
P = b["prompts"].shape[1]
with open("rollouts.jsonl", "a") as f:
    for i in range(len(b["responses"])):
        prompt = b["input_ids"][i, :P][b["attention_mask"][i, :P].bool()].tolist()
        n = int(b["attention_mask"][i, P:].sum())
        f.write(json.dumps({"step": step, "group": str(uid[i]), "prompt": prompt,
            "response": b["responses"][i, :n].tolist(), "advantage": b["advantages"][i, :n].tolist(),
            "loss_mask": b["response_mask"][i, :n].tolist(),
            "old_logprobs": b["old_log_probs"][i, :n].tolist(),
            "ref_logprobs": b["ref_log_prob"][i, :n].tolist()}) + "\n")
