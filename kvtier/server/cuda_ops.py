"""The GPU path's handlers (engine memory by CUDA IPC, kvtier/engine/cuda_path.py): the
work behind RegisterCuda, CudaPut, CudaGet and CudaWait and their session-socket ops.

Apart from the servicer because they share nothing with it but its checks, which it hands
in: the namespace id, the byte admission and the dropping of an ended session's leases.
Without a GPU path (gpu.device = -1) every call is UNIMPLEMENTED with what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier._proto import kvtier_pb2 as pb
from kvtier.config import LimitsConfig
from kvtier.engine.cuda_path import CudaBlock, CudaPath
from kvtier.errors import Unimplemented
from kvtier.keys import check_key
from kvtier.server.messages import commit_results, cuda_got


class CudaOps:
    def __init__(
        self,
        cuda: CudaPath | None,
        limits: Callable[[], LimitsConfig],
        ns_id: Callable[[str, str], str],
        admit_bytes: Callable[[str, int], None],
        drop_if_session_ended: Callable[[int], None],
    ) -> None:
        self._cuda = cuda
        self._limits = limits  # read per call: a reload may change them
        self._ns_id = ns_id
        self._admit_bytes = admit_bytes
        self._drop_if_session_ended = drop_if_session_ended

    def _path(self) -> CudaPath:
        if self._cuda is None:
            raise Unimplemented(
                "this daemon serves no GPU (gpu.device = -1): start it with gpu.device set "
                "on the GPU node, or use put_many/get_many (the shared arena)"
            )
        return self._cuda

    def _blocks(self, tenant: str, blocks: Iterable[pb.CudaBlock]) -> list[CudaBlock]:
        max_key_bytes = self._limits().max_key_bytes
        out = [
            CudaBlock(check_key(b.key, max_key_bytes), b.offset_bytes, b.size_bytes) for b in blocks
        ]
        self._admit_bytes(tenant, sum(b.size_bytes for b in out))
        return out

    async def register(
        self, session_id: int, tenant: str, request: pb.RegisterCudaRequest
    ) -> pb.RegisterCudaResponse:
        buffer_id = self._path().register(
            session_id,
            tenant,
            request.device,
            request.ipc_handle,
            request.offset_bytes,
            request.size_bytes,
        )
        return pb.RegisterCudaResponse(buffer_id=buffer_id)

    async def put(
        self, session_id: int, tenant: str, request: pb.CudaPutRequest
    ) -> pb.CudaPutResponse:
        cuda = self._path()
        ns_id = self._ns_id(tenant, request.namespace)
        blocks = self._blocks(tenant, request.blocks)
        outcomes = await cuda.put(session_id, ns_id, request.buffer_id, blocks, request.overwrite)
        return pb.CudaPutResponse(results=commit_results(outcomes))

    async def get(
        self, session_id: int, tenant: str, request: pb.CudaGetRequest
    ) -> pb.CudaGetResponse:
        cuda = self._path()
        ns_id = self._ns_id(tenant, request.namespace)
        blocks = self._blocks(tenant, request.blocks)
        if request.group_sizes:
            request_id = cuda.start_get(
                session_id, ns_id, request.buffer_id, blocks, list(request.group_sizes)
            )
            return pb.CudaGetResponse(request_id=request_id)
        tiers = await cuda.get(session_id, ns_id, request.buffer_id, blocks)
        self._drop_if_session_ended(session_id)
        return cuda_got(tiers)

    async def wait(
        self, session_id: int, tenant: str, request: pb.CudaWaitRequest
    ) -> pb.CudaGetResponse:
        tiers = await self._path().wait(session_id, request.request_id, request.group)
        self._drop_if_session_ended(session_id)
        return cuda_got(tiers)
