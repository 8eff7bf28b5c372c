"""Loaded at interpreter start (on PYTHONPATH) by tools/ring-tests/run, before the tests import
anything."""
# The HF adapter of ring_flash_attn imports transformers internals that vary by version; its tests
# do not use it, so it is replaced by a stub module before ring_flash_attn imports it.
import sys, types
m = types.ModuleType("ring_flash_attn.adapters")
def _unavailable(*a, **k):
    raise RuntimeError("hf adapter stubbed out for this run")
m.substitute_hf_flash_attn = _unavailable
m.update_ring_flash_attn_params = _unavailable
sys.modules["ring_flash_attn.adapters"] = m

# RING_ONE_GPU=1: several ranks sharing one GPU. NCCL refuses two ranks on one device, so the
# process group is gloo and every collective or point-to-point call on CUDA tensors is staged
# through host memory (bytes, dtype-agnostic where the op allows it).
import os
if os.environ.get("RING_ONE_GPU") == "1":
    import torch
    import torch.distributed as dist

    _init = dist.init_process_group
    def _init_gloo(backend=None, *a, **k):
        return _init("gloo", *a, **k)
    dist.init_process_group = _init_gloo

    _set_device = torch.cuda.set_device
    torch.cuda.set_device = lambda d: _set_device(0)

    def _bytes(t):
        return t.detach().contiguous().view(torch.uint8).cpu() if t.element_size() > 0 else t.cpu()

    class _Done:
        def __init__(self, fn=None): self.fn = fn
        def wait(self, *a, **k):
            if self.fn: self.fn(); self.fn = None
            return True
        def is_completed(self): return self.fn is None

    def _batch(ops):
        works, sends, recvs = [], 0, 0
        for op in ops:
            name = getattr(op.op, "__name__", "")
            if "send" in name:
                buf = op.tensor.detach().contiguous().cpu()
                w = dist.isend(buf, op.peer, group=op.group, tag=sends); sends += 1
                works.append(_Done(lambda w=w, buf=buf: w.wait()))
            else:
                buf = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                w = dist.irecv(buf, op.peer, group=op.group, tag=recvs); recvs += 1
                def fin(w=w, buf=buf, t=op.tensor):
                    w.wait(); t.copy_(buf.to(t.device))
                works.append(_Done(fin))
        return works
    dist.batch_isend_irecv = _batch

    _broadcast = dist.broadcast
    def _bcast(tensor, src, group=None, async_op=False):
        if tensor.is_cuda:
            buf = tensor.detach().contiguous().cpu()
            _broadcast(buf.view(torch.uint8) if buf.dim() else buf, src, group=group)
            with torch.no_grad(): tensor.copy_(buf.to(tensor.device))
            return _Done() if async_op else None
        return _broadcast(tensor, src, group=group, async_op=async_op)
    dist.broadcast = _bcast

    def _all_gather_into(output, input, group=None, async_op=False):
        n = dist.get_world_size(group)
        src = input.detach().contiguous().cpu()
        parts = [torch.empty_like(src) for _ in range(n)]
        dist.all_gather([p.view(torch.uint8) for p in parts], src.view(torch.uint8), group=group)
        output.copy_(torch.cat(parts, 0).to(output.device).view(output.shape))
        return _Done() if async_op else None
    dist.all_gather_into_tensor = _all_gather_into

    def _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        x = input.detach().float().cpu()
        dist.all_reduce(x, op=op, group=group)
        output.copy_(x.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)].to(output.device))
        return _Done() if async_op else None
    dist.reduce_scatter_tensor = _reduce_scatter
