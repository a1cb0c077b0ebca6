// A tiny OpenAI-shaped engine for bench/dataplane_bench.py: fast enough that the gateway
// in front of it, not the engine, is what the benchmark measures. Standard library only
// (Debian's Go 1.19).
//
// It serves the same handler on -replicas loopback ports (each looks like one engine
// replica to a gateway) and prints one line per port:
//
//	fast engine serving MODEL on http://127.0.0.1:PORT
//
// Endpoints: POST /v1/chat/completions and /v1/completions (plain JSON, or with
// "stream": true server-sent events: -chunks data events, one every -interval, then
// "data: [DONE]"; usage only with stream_options.include_usage, as vLLM); POST
// /v1/chat/completions/render, /v1/completions/render and /tokenize (see tokenize); GET
// /health, /v1/models, /metrics (vLLM's load gauges, which llmgw's cache-aware balancing
// reads) and /bench/stats (requests served per port and path, as JSON, so the benchmark can
// tell what each gateway asked besides the proxied requests).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

type engine struct {
	model    string
	ownedBy  string // what its /v1/models says: "vllm" makes llmgw ask for token ids
	chunks   int // data events per stream: a role chunk, chunks-2 tokens, a finish chunk
	interval time.Duration
	running  int64 // requests being answered now (vllm:num_requests_running)
	served   int64

	mu    sync.Mutex
	paths map[string]int64 // "PORT METHOD PATH": requests served; "PORT connections": opened
}

// replica is one port's handler: the same engine, its requests counted apart.
type replica struct {
	*engine
	port string
}

type request struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	MaxTokens     *int   `json:"max_tokens"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	ReturnTokenIDs bool `json:"return_token_ids"` // as vLLM: ids on every event
}

var token = []string{"The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."}

func (e *engine) count(key string) {
	e.mu.Lock()
	e.paths[key]++
	e.mu.Unlock()
}

func (rp replica) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e := rp.engine
	e.count(rp.port + " " + r.Method + " " + r.URL.Path)
	switch r.URL.Path {
	case "/v1/chat/completions":
		e.generate(w, r, true)
	case "/v1/completions":
		e.generate(w, r, false)
	case "/v1/chat/completions/render", "/v1/completions/render", "/tokenize":
		e.tokenize(w, r)
	case "/health":
		w.WriteHeader(http.StatusOK)
	case "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","created":0,"owned_by":%q,"max_model_len":4096}]}`, e.model, e.ownedBy)
	case "/metrics":
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		running := atomic.LoadInt64(&e.running)
		fmt.Fprintf(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=%q} %d\n"+
			"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=%q} 0\n"+
			"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=%q} 0\n"+
			"# TYPE vllm:request_success_total counter\nvllm:request_success_total{model_name=%q} %d\n",
			e.model, running, e.model, e.model, e.model, atomic.LoadInt64(&e.served))
	case "/bench/stats":
		e.mu.Lock()
		keys := make([]string, 0, len(e.paths))
		for k := range e.paths {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		out := make(map[string]int64, len(keys))
		for _, k := range keys {
			out[k] = e.paths[k]
		}
		e.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	default:
		http.NotFound(w, r)
	}
}

// tokenize answers vLLM's render endpoints ({"token_ids": [...]}) and /tokenize ({"count",
// "max_model_len", "tokens"}): vllm-router's cache-aware policy asks one of them for every
// request. The "tokens" are the prompt's bytes, four to a token, after a plain chat template:
// made up, but deterministic and prefix-preserving, which is all a router's tree needs.
func (e *engine) tokenize(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
		Prompt json.RawMessage `json:"prompt"`
	}
	body, err := io.ReadAll(r.Body)
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	if err != nil || r.Method != http.MethodPost {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"error":{"message":%q,"type":"invalid_request_error"}}`, "bad request")
		return
	}
	var text []byte
	for _, m := range req.Messages {
		text = append(text, "<|"+m.Role+"|>"...)
		var s string
		if json.Unmarshal(m.Content, &s) == nil {
			text = append(text, s...)
		} else {
			text = append(text, m.Content...)
		}
		text = append(text, '\n')
	}
	if len(req.Messages) > 0 {
		text = append(text, "<|assistant|>"...)
	} else {
		var s string
		if json.Unmarshal(req.Prompt, &s) == nil {
			text = append(text, s...)
		} else {
			text = append(text, req.Prompt...)
		}
	}
	ids := make([]byte, 0, len(text)*2)
	ids = append(ids, '[')
	for i := 0; i < len(text); i += 4 {
		var v uint32
		for j := i; j < i+4 && j < len(text); j++ {
			v = v*257 + uint32(text[j])
		}
		if i > 0 {
			ids = append(ids, ',')
		}
		ids = strconv.AppendUint(ids, uint64(v%150000), 10)
	}
	ids = append(ids, ']')
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Path == "/tokenize" {
		fmt.Fprintf(w, `{"count":%d,"max_model_len":4096,"tokens":%s,"token_strs":null}`, (len(text)+3)/4, ids)
	} else {
		fmt.Fprintf(w, `{"token_ids":%s,"features":null}`, ids)
	}
}

func (e *engine) generate(w http.ResponseWriter, r *http.Request, chat bool) {
	if r.Method != http.MethodPost {
		http.Error(w, `{"error":{"message":"POST only"}}`, http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(r.Body)
	var req request
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	if err != nil {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"error":{"message":%q,"type":"invalid_request_error"}}`, "bad JSON body: "+err.Error())
		return
	}
	atomic.AddInt64(&e.running, 1)
	defer atomic.AddInt64(&e.running, -1)
	defer atomic.AddInt64(&e.served, 1)
	tokens := e.chunks - 2
	if req.MaxTokens != nil && *req.MaxTokens >= 0 && *req.MaxTokens < tokens {
		tokens = *req.MaxTokens
	}
	if tokens < 0 {
		tokens = 0
	}
	model := req.Model
	if model == "" {
		model = e.model
	}
	id := "bench-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	created := time.Now().Unix()
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`,
		len(body)/4, tokens, len(body)/4+tokens)
	if !req.Stream {
		text := ""
		for i := 0; i < tokens; i++ {
			text += token[i%len(token)]
		}
		w.Header().Set("Content-Type", "application/json")
		if chat {
			fmt.Fprintf(w, `{"id":%q,"object":"chat.completion","created":%d,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"length"}],"usage":%s}`,
				id, created, model, text, usage)
		} else {
			fmt.Fprintf(w, `{"id":%q,"object":"text_completion","created":%d,"model":%q,"choices":[{"index":0,"text":%q,"finish_reason":"length"}],"usage":%s}`,
				id, created, model, text, usage)
		}
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "no streaming", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	done := r.Context().Done()
	var head string
	if chat {
		head = fmt.Sprintf(`data: {"id":%q,"object":"chat.completion.chunk","created":%d,"model":%q,"choices":[{"index":0,`, id, created, model)
	} else {
		head = fmt.Sprintf(`data: {"id":%q,"object":"text_completion","created":%d,"model":%q,"choices":[{"index":0,`, id, created, model)
	}
	// Event i of tokens+2: the role (chat) or an empty text, the tokens, the finish reason.
	for i := 0; i < tokens+2; i++ {
		if i > 0 && e.interval > 0 {
			select {
			case <-done:
				return
			case <-time.After(e.interval):
			}
		}
		var event string
		// With return_token_ids, as vLLM writes them: the prompt's ids on the first event
		// (a chat's beside its choices, a completion's in its choice), each token's own.
		ids, promptIDs, chatPromptIDs := "", "", ""
		if req.ReturnTokenIDs {
			ids = fmt.Sprintf(`,"token_ids":[%d]`, 100+i)
			if i == 0 && chat {
				chatPromptIDs = `,"prompt_token_ids":[0,11,12,13,14,15,16,17]`
			} else if i == 0 {
				promptIDs = `,"prompt_token_ids":[0,11,12,13,14,15,16,17]`
			} else {
				promptIDs = `,"prompt_token_ids":null`
			}
		}
		switch {
		case i == 0 && chat:
			event = head + `"delta":{"role":"assistant","content":""},"finish_reason":null}]` + chatPromptIDs + "}\n\n"
		case i == 0:
			event = head + `"text":"","finish_reason":null` + promptIDs + `}]}` + "\n\n"
		case i == tokens+1 && chat:
			event = head + `"delta":{},"finish_reason":"length"}]}` + "\n\n"
		case i == tokens+1:
			event = head + `"text":"","finish_reason":"length"` + promptIDs + `}]}` + "\n\n"
		case chat:
			event = head + fmt.Sprintf(`"delta":{"content":%q},"finish_reason":null%s}]}`, token[(i-1)%len(token)], ids) + "\n\n"
		default:
			event = head + fmt.Sprintf(`"text":%q,"finish_reason":null%s%s}]}`, token[(i-1)%len(token)], promptIDs, ids) + "\n\n"
		}
		if _, err := io.WriteString(w, event); err != nil {
			return
		}
		flusher.Flush()
	}
	if req.StreamOptions.IncludeUsage { // as vLLM: one more event, no choices, only when asked
		_, _ = io.WriteString(w, head[:len(head)-len(`"choices":[{"index":0,`)]+`"choices":[],"usage":`+usage+"}\n\n")
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
	flusher.Flush()
}

func main() {
	model := flag.String("model", "bench", "the model name served")
	host := flag.String("host", "127.0.0.1", "address to listen on")
	replicas := flag.Int("replicas", 1, "ports to serve on (port 0: free ones), each a replica to a gateway")
	port := flag.Int("port", 0, "first port (0: a free port per replica)")
	chunks := flag.Int("chunks", 50, "data events per stream before [DONE] (role chunk, tokens, finish chunk)")
	interval := flag.Duration("interval", time.Millisecond, "pause between stream events (0: none)")
	ownedBy := flag.String("owned-by", "bench", "the owned_by of its /v1/models (vllm: as vLLM says)")
	flag.Parse()
	if *chunks < 2 || *replicas < 1 {
		log.Fatal("need -chunks >= 2 and -replicas >= 1")
	}
	e := &engine{model: *model, ownedBy: *ownedBy, chunks: *chunks, interval: *interval, paths: map[string]int64{}}
	errs := make(chan error, *replicas)
	for i := 0; i < *replicas; i++ {
		p := 0
		if *port != 0 {
			p = *port + i
		}
		ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(p)))
		if err != nil {
			log.Fatal(err)
		}
		// Keep-alive like a real engine; an idle connection is closed after a while.
		_, portText, _ := net.SplitHostPort(ln.Addr().String())
		srv := &http.Server{
			Handler: replica{e, portText}, IdleTimeout: 120 * time.Second, ReadHeaderTimeout: 10 * time.Second,
			// Connections opened, so that the benchmark sees whether a gateway keeps them alive.
			ConnState: func(_ net.Conn, state http.ConnState) {
				if state == http.StateNew {
					e.count(portText + " connections")
				}
			},
		}
		fmt.Fprintf(os.Stdout, "fast engine serving %s on http://%s\n", *model, ln.Addr().String())
		go func() { errs <- srv.Serve(ln) }()
	}
	log.Fatal(<-errs)
}
