//! The connections a gRPC server takes from its listener.

/// The connections a gRPC server should serve from `listener`, with Nagle's
/// algorithm off. tonic sets TCP_NODELAY only on listeners it binds itself;
/// without it a response spanning several segments, or a stream of small
/// messages, waits out the peer's delayed ACK (about 40 ms each time).
pub(crate) fn incoming(
    listener: tokio::net::TcpListener,
    gate: crate::limits::Gate,
) -> impl tokio_stream::Stream<Item = std::io::Result<crate::limits::Guarded<tokio::net::TcpStream>>>
{
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |conn| {
        let conn = match conn {
            Ok(conn) => conn,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = conn.set_nodelay(true) {
            return Some(Err(e));
        }
        // None: over the connection cap, closed here
        let peer = conn.peer_addr().ok();
        gate.admit_from(conn, peer).map(Ok)
    })
}
