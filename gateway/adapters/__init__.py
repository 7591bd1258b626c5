"""LoRA adapters a tenant runs on a tier: what names one (`model: "small:NAME"`, a policy's default), where its
files are kept and who may use it (`store`: one tenant's rows and folder serve that tenant only), and putting it
on the engine that serves it before its requests are opened (`loading`); distilling one from the large tier's
answers (`distill`, and `schedule`: on a policy's schedule), imported by module, not here (they load the trainer).
The engine side, many adapters in one batch, is `engines.lora`."""

from gateway.adapters.loading import AdapterLoader
from gateway.adapters.names import ADAPTER_NAME, split_model
from gateway.adapters.store import AdapterConflict, AdapterRecord, AdapterStore, UnknownAdapter

__all__ = [
    "ADAPTER_NAME",
    "AdapterConflict",
    "AdapterLoader",
    "AdapterRecord",
    "AdapterStore",
    "UnknownAdapter",
    "split_model",
]
