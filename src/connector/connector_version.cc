// The connector layer (layouts, block mapping, read/write modes) lands here; see issue 4.
namespace kvwire::connector {
// Version of the kv_transfer_params JSON the connector reads and writes.
int KvTransferParamsVersion() { return 1; }
}  // namespace kvwire::connector
