package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
)

// fakeAgent serves handler on a unix socket and returns a plugin that talks to it.
func fakeAgent(t *testing.T, handler http.HandlerFunc) *plugin {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return &plugin{
		token:   "tok",
		timeout: time.Second,
		client: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
		}},
	}
}

func guaranteedContainer() (*api.PodSandbox, *api.Container) {
	pod := &api.PodSandbox{
		Id: "pod1", Uid: "uid-1", Namespace: "default", Name: "web",
		Annotations: map[string]string{"nodeagent.io/numa": "single", "other.io/x": "y"},
		Linux:       &api.LinuxPodSandbox{CgroupParent: "/kubepods/poduid-1"},
	}
	ctr := &api.Container{
		Id: "c1", PodSandboxId: "pod1", Name: "app", State: api.ContainerState_CONTAINER_CREATED,
		Linux: &api.LinuxContainer{Resources: &api.LinuxResources{
			Cpu:    &api.LinuxCPU{Shares: api.UInt64(uint64(1024)), Quota: api.Int64(int64(100000)), Period: api.UInt64(uint64(100000))},
			Memory: &api.LinuxMemory{Limit: api.Int64(int64(64 << 20))},
		}},
	}
	return pod, ctr
}

func TestCreateForwardsTheContainerAndAppliesTheAnswer(t *testing.T) {
	var got container
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/nri/containers" || r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusTeapot)
			return
		}
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &got)
		_, _ = w.Write([]byte(`{"container_id":"c1","slot_id":"s1","slot_name":"nri-c1","qos":"guaranteed","cpuset_cpus":"3","cpuset_mems":"0","memory_limit":67108864}`))
	})
	pod, ctr := guaranteedContainer()
	adj, updates, err := p.CreateContainer(context.Background(), pod, ctr)
	if err != nil || updates != nil {
		t.Fatalf("CreateContainer: %v %v", err, updates)
	}
	if got.ID != "c1" || got.Pod.CgroupParent != "/kubepods/poduid-1" || got.Resources.CPUQuota != 100000 ||
		got.Resources.MemoryLimit != 64<<20 || got.Pod.Annotations["nodeagent.io/numa"] != "single" {
		t.Fatalf("sent %+v", got)
	}
	if _, ok := got.Pod.Annotations["other.io/x"]; ok {
		t.Fatalf("forwarded an annotation that is not the agent's: %+v", got.Pod.Annotations)
	}
	res := adj.GetLinux().GetResources()
	if res.GetCpu().GetCpus() != "3" || res.GetCpu().GetMems() != "0" || res.GetMemory().GetLimit().GetValue() != 64<<20 {
		t.Fatalf("adjustment %+v", res)
	}
}

func TestARefusalFailsTheCreationWithTheAgentsReason(t *testing.T) {
	p := fakeAgent(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusConflict)
		_, _ = w.Write([]byte(`{"error":{"code":"does_not_fit","message":"need 3 exclusive CPUs"}}`))
	})
	pod, ctr := guaranteedContainer()
	_, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err == nil || !strings.Contains(err.Error(), "nodeagent refused (409 does_not_fit): need 3 exclusive CPUs") {
		t.Fatalf("error %v", err)
	}
}

func TestAnAgentThatDoesNotAnswerFailsTheCreationInTime(t *testing.T) {
	p := fakeAgent(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	p.timeout = 100 * time.Millisecond
	pod, ctr := guaranteedContainer()
	_, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err == nil || !strings.Contains(err.Error(), "nodeagent did not answer") {
		t.Fatalf("error %v", err)
	}
}

func TestSynchronizeLeavesStoppedContainersOutAndTurnsUpdates(t *testing.T) {
	var sent struct {
		Containers []container `json:"containers"`
	}
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &sent)
		_, _ = w.Write([]byte(`{"updates":[{"container_id":"c1","slot_id":"s1","slot_name":"nri-c1","qos":"guaranteed","cpuset_cpus":"3","cpuset_mems":"0","memory_limit":0},{"container_id":"c3","slot_id":"s3","slot_name":"nri-c3","qos":"best-effort"}],"released":[],"refused":{}}`))
	})
	pod, ctr := guaranteedContainer()
	stopped := &api.Container{Id: "c2", PodSandboxId: "pod1", State: api.ContainerState_CONTAINER_STOPPED}
	updates, err := p.Synchronize(context.Background(), []*api.PodSandbox{pod}, []*api.Container{ctr, stopped})
	if err != nil {
		t.Fatal(err)
	}
	if len(sent.Containers) != 1 || sent.Containers[0].ID != "c1" || sent.Containers[0].Pod.Name != "web" {
		t.Fatalf("sent %+v", sent.Containers)
	}
	if len(updates) != 1 || updates[0].GetContainerId() != "c1" || updates[0].GetLinux().GetResources().GetCpu().GetCpus() != "3" {
		t.Fatalf("updates %+v", updates)
	}
}

func TestFailOpenCreatesUnplacedOnlyWhileTheAgentDoesNotAnswer(t *testing.T) {
	p := fakeAgent(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	p.timeout = 100 * time.Millisecond
	p.failOpen = true
	pod, ctr := guaranteedContainer()
	adj, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err != nil || adj != nil {
		t.Fatalf("fail-open: %v %v", adj, err)
	}
	if !p.lost.Load() {
		t.Fatal("the agent is not marked lost: no Synchronize would place the container later")
	}
	refusing := fakeAgent(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(`{"error":{"code":"invalid_request","message":"unknown annotation"}}`))
	})
	refusing.failOpen = true
	if _, _, err := refusing.CreateContainer(context.Background(), pod, ctr); err == nil {
		t.Fatal("a refusal must fail the creation even with -fail-open")
	}
}
