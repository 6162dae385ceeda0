// The do-nothing ext_proc server of chaos/bench/ext_proc_floor.py, outside Python: Node.js with
// @grpc/grpc-js (one thread, HTTP/2 in Node's own nghttp2), for `python -m
// chaos.bench.ext_proc_variants --variants node`: what the protocol costs Envoy when the server
// is not grpc.aio. Messages are passed as bytes and the few fields it needs are read and written
// by hand; the answers that do not depend on the request are built by the Python side with
// guard/epp/messages.py and passed in as hex.
//
//   NODE_PATH=/path/to/node_modules node ext_proc_floor_node.js PORT HEADERS_ANSWER \
//       RESPONSE_HEADERS_ANSWER REQUEST_TRAILERS_ANSWER RESPONSE_TRAILERS_ANSWER
//
// Prints "ext_proc floor listening on grpc://127.0.0.1:PORT" once it serves; answers gRPC health
// checks SERVING.
"use strict";
const grpc = require("@grpc/grpc-js");

const [port, headersAnswer, responseHeadersAnswer, requestTrailers, responseTrailers] =
  process.argv.slice(2).map((arg, i) => (i === 0 ? Number(arg) : Buffer.from(arg, "hex")));

function varint(value) {
  const out = [];
  while (value > 127) {
    out.push((value & 127) | 128);
    value = Math.floor(value / 128);
  }
  out.push(value);
  return Buffer.from(out);
}

function lengthDelimited(number, payload) {
  return Buffer.concat([varint((number << 3) | 2), varint(payload.length), payload]);
}

function readVarint(buf, pos) {
  let value = 0;
  let scale = 1;
  let byte;
  do {
    byte = buf[pos++];
    value += (byte & 127) * scale;
    scale *= 128;
  } while (byte & 128);
  return [value, pos];
}

// the top-level fields of a message: [number, Buffer (length-delimited) or number (varint)]
function fields(buf) {
  const out = [];
  let pos = 0;
  while (pos < buf.length) {
    let key;
    [key, pos] = readVarint(buf, pos);
    const number = Math.floor(key / 8);
    const wireType = key & 7;
    if (wireType === 2) {
      let length;
      [length, pos] = readVarint(buf, pos);
      out.push([number, buf.subarray(pos, pos + length)]);
      pos += length;
    } else if (wireType === 0) {
      let value;
      [value, pos] = readVarint(buf, pos);
      out.push([number, value]);
    } else if (wireType === 1 || wireType === 5) {
      pos += wireType === 1 ? 8 : 4;
    } else {
      throw new Error(`wire type ${wireType}`);
    }
  }
  return out;
}

// HttpBody {bytes body = 1; bool end_of_stream = 2;} (HttpHeaders: end_of_stream = 3)
function bodyOf(message) {
  let body = Buffer.alloc(0);
  let endOfStream = false;
  for (const [number, value] of fields(message)) {
    if (number === 1) body = value;
    if (number === 2) endOfStream = value !== 0;
  }
  return [body, endOfStream];
}

// ProcessingResponse {request_body = 3 | response_body = 4: BodyResponse {CommonResponse
// response = 1 {BodyMutation body_mutation = 3 {StreamedBodyResponse streamed_response = 3
// {bytes body = 1; bool end_of_stream = 2}}}}}
function bodyAnswer(top, chunk, endOfStream) {
  let streamed = lengthDelimited(1, chunk);
  if (endOfStream) streamed = Buffer.concat([streamed, Buffer.from([0x10, 1])]);
  const common = lengthDelimited(3, lengthDelimited(3, streamed));
  return lengthDelimited(top, lengthDelimited(1, common));
}

function process_(call) {
  const chunks = [];
  call.on("data", (message) => {
    for (const [number, value] of fields(message)) {
      if (number === 5) { // response_body: passed back unchanged
        const [body, endOfStream] = bodyOf(value);
        call.write(bodyAnswer(4, body, endOfStream));
      } else if (number === 3) { // response_headers
        call.write(responseHeadersAnswer);
      } else if (number === 4) { // request_body: the pick with the body re-emitted
        const [body, endOfStream] = bodyOf(value);
        chunks.push(body);
        if (endOfStream) {
          call.write(headersAnswer);
          call.write(bodyAnswer(3, Buffer.concat(chunks), true));
        }
      } else if (number === 2) { // request_headers: answered here only without a body
        if (fields(value).some(([n, v]) => n === 3 && v !== 0)) call.write(headersAnswer);
      } else if (number === 6) {
        call.write(requestTrailers);
      } else if (number === 7) {
        call.write(responseTrailers);
      }
    }
  });
  call.on("end", () => call.end());
  call.on("error", () => {});
}

const raw = { requestSerialize: (b) => b, requestDeserialize: (b) => b,
              responseSerialize: (b) => b, responseDeserialize: (b) => b };
const server = new grpc.Server();
server.addService({ Process: { path: "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                               requestStream: true, responseStream: true, ...raw } },
                  { Process: process_ });
server.addService({ Check: { path: "/grpc.health.v1.Health/Check", requestStream: false,
                             responseStream: false, ...raw } },
                  { Check: (_call, callback) => callback(null, Buffer.from([0x08, 1])) });
server.bindAsync(`127.0.0.1:${port}`, grpc.ServerCredentials.createInsecure(), (err, bound) => {
  if (err) throw err;
  console.log(`ext_proc floor listening on grpc://127.0.0.1:${bound}`);
});
process.on("SIGTERM", () => process.exit(0));
